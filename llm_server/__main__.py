from .server import main

if __name__ == "__main__":  # vLLM spawns engine processes that re-import the main module
    main()
