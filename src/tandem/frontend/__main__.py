from tandem.frontend.main import main

raise SystemExit(main())
