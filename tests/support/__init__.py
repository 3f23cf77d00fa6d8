"""Helpers shared by the tests: real JPEGs, real servers, the DataLoader oracle."""
