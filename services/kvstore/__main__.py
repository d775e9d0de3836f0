from services.kvstore.server import main

main()
