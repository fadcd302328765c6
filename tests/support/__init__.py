"""Helpers the tests share; test modules import from here, never from each other."""
