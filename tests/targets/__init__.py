"""The WeightTarget contract (contract.py) and one module per implementation."""
