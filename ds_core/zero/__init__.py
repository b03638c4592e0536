"""The ZeRO engine: configuration, partitioning per stage, precision, clipping, accumulation."""
