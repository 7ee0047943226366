"""distrl: a Ray-distributed actor/learner service for RL post-training of LLMs.

Layout (imports flow one way): config, types -> algo -> workers -> cluster -> driver -> cli.
"""

__version__ = "0.1.0"
