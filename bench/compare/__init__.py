"""qflow against RabbitMQ, side by side in one run: ``make bench-compare``.

Installs Debian's ``rabbitmq-server`` (apt) if it is missing, starts a private
RabbitMQ node on 127.0.0.1 (free ports, its own epmd, data, logs and config
under a temporary folder, no plugins), starts one qflowd, and runs the same
workloads against both, interleaved (qflow, RabbitMQ, qflow, RabbitMQ ...).
Every client is its own process, as a user's would be. bench/README.md says
exactly what each side does in each workload.

Figures drift on these shared 2-core machines, so only ratios measured in this
one run mean anything; the spin-loop probe before and after shows how much
the machine drifted meanwhile. The last line printed is one JSON object.

    python bench/compare            # default run, several minutes
    python bench/compare --quick    # a minute or two

The modules: ``brokers`` (the qflowd and the private RabbitMQ node),
``clients`` (the client processes, one per producer or consumer),
``workloads`` (what each workload sets up and runs), ``report`` (the tables
and the JSON line) and ``__main__`` (options, and the order of it all).
"""
