import sys

from rlix_async.cli import main

sys.exit(main())
