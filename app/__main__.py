"""`python -m app ask ...` / `python -m app tool ...`"""

from app.cli import main

raise SystemExit(main())
