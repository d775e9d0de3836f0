from services.decode.server import main

main()
