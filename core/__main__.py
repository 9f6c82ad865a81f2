from srv.cli.main import main

raise SystemExit(main())
