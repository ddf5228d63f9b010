from tandem.cli.frontend import main

raise SystemExit(main())
