"""Datasets asyncfeed ships: image folders, the image decoder, WebDataset tar shards."""
