"""The vocabulary every stage shares: what a program is made of.

``signature``: what a captured step's graph takes and gives back (placeholder kinds,
tensor metas). ``node_meta``: the keys stages write on fx nodes, with typed accessors.
``collectives``: which ops are collectives, their kind, waits and payload bytes.
``graph_utils``: small fx helpers.
"""
