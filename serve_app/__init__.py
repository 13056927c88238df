"""kvroute's decision and HTTP plane: snapshot follower, ledger, policies, proxy, Serve app, CLI."""
