import sys

from pdruntime.server.commands import main

sys.exit(main())
