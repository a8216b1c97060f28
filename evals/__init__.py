"""Evaluation: the batched generation engine at served decoding, one scorer per file, paired
statistics, the noise floor and pre-registered promotion bars.
"""
