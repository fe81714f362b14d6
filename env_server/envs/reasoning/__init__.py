"""The reasoning family: reasoning-gym's procedural datasets, one single-question env per dataset."""
