"""Sizing the swarm before it is built: ``kvasir calibrate`` measures costs, ``kvasir plan`` simulates."""
