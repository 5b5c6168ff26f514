"""Simulation and offline tools: the simulated worker, step-time profiles, their fit and sweep, and replay."""
