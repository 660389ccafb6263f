"""Frontends: how models written for other frameworks reach Kiln (`kiln.frontend.torch`)."""
