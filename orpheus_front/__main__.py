from .front import main

main()
