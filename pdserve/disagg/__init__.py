"""PD handoff pieces, torch-free: handoff state machines (handoff), DP-rank rules (dp_rules),
the bootstrap table, HTTP service and client. Import the submodules directly; this package
imports nothing so that the pure parts do not pull in aiohttp or httpx.
"""
