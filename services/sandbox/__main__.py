from services.sandbox.server import main

main()
