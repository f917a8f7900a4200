"""The vocabulary every role shares: the attempt, the fault, settings and paths.

Relay's bottom layer. It may import the standard library, ``relay_train.protocol``
and nothing else of Relay: every other folder may import it.
"""
