"""Shared vocabulary of pdserve: config, envs, messages, errors. Standard library only."""
