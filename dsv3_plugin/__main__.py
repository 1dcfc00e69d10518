from dsv3_plugin.cli import main

raise SystemExit(main())
