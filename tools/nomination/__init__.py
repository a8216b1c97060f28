"""The nomination: the serving bundle writer, the model card, check-bundle and publishing.
"""
