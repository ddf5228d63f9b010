from tandem.cli.main import main

if __name__ == "__main__":  # vLLM's spawned children re-import the main module
    raise SystemExit(main())
