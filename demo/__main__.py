from demo.app import main

main()
