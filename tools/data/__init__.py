"""The data machinery: human feedback and its validation, the splits, the leak audit and the dataset builders.
"""
