"""CPU side of the engine: requests, KV block pools, scheduler, step contracts.

Everything in this package is pure Python (no torch) so it can be tested on
CPU with hand-made runner outputs.
"""
