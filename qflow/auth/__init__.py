"""Who may connect: the users file (``--sasl-db``) that qflowd reads and
``qflow-passwd`` writes. The SASL mechanisms themselves are part of the wire
protocol (qflow.protocol.sasl); this is only where their verifiers are kept.
"""
