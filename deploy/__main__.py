"""``python -m deploy``: the ``stargym`` command, without relying on the console script being on PATH."""

from deploy.cli import app

app(prog_name="stargym")
