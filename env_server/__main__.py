"""``python -m env_server FAMILY [--port N]``: the same server as ``stargym env serve``."""

from env_server.serve import main

main()
