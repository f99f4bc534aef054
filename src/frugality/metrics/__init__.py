"""What a run costs and achieves: FLOP counts, measured device peaks, and the run log."""
