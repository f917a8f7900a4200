"""The recovery policy: governance's YAML, its rules and the one pure decision.

``model`` validates a policy file, ``rules`` holds one rule per fault kind,
``decide`` maps (fault, history, policy) to a decision, ``explain`` says it in
plain words, ``replay`` re-decides recorded faults, ``observe`` records what would
be done, ``notify`` tells the escalation target. May import ``relay.lineage``,
``relay.launchers``, ``relay.nodes``, ``relay.spec`` and ``relay.core``.
"""
