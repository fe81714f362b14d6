"""The kit every stargym service is built from: wire protocol, settings, HTTP app factory, clients.

Services never import each other; whatever two of them must agree on lives here.
"""
