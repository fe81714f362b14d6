"""Ways to run stargym: the ``stargym`` CLI, the local launcher, containers and manifests."""
