"""AMQP 1.0, sans I/O: the type codec (:mod:`.codec`), performatives
(:mod:`.performatives`), framing (:mod:`.frames`), message sections
(:mod:`.message`) and the server side of a connection (:mod:`.connection`,
whose events are in :mod:`.events`). docs/amqp.md says what is supported."""
