import sys

from ringft.cli import main

sys.exit(main())
