from services.orchestrator.app import main

main()
