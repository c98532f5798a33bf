import sys

from shardlm.cli import main

sys.exit(main())
