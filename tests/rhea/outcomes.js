// Receives from ADDRESS without accepting, and ends each delivery with the next outcome of OUTCOMES
// (comma-separated: accept, release, modified, reject); exits after the last.
// Usage: node outcomes.js PORT ADDRESS OUTCOMES
// Prints one JSON object a line per delivery: {"body": ..., "delivery_count": n, "outcome": ...};
// {"error": "..."} and exit code 1 if the connection or the link fails.
'use strict';
const rhea = require('rhea');
const [port, address, list] = process.argv.slice(2);
const outcomes = list.split(',');
// A data section (what a qflow body becomes) as {"data": its text}; other bodies as rhea gives them.
const shown = (body) => (body && body.typecode === 0x75 ? { data: body.content.toString('utf8') } : body);
const report = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const fail = (what, error) => {
    report({ error: `${what}: ${error && (error.condition || error.message || error)}` });
    process.exit(1);
};

const container = rhea.create_container({ id: 'rhea-outcomes' });
let n = 0;
container.on('message', (context) => {
    const outcome = outcomes[n];
    n += 1;
    report({ body: shown(context.message.body), delivery_count: context.message.delivery_count || 0, outcome });
    const delivery = context.delivery;
    if (outcome === 'accept') delivery.accept();
    else if (outcome === 'release') delivery.release();
    else if (outcome === 'modified') delivery.modified({ delivery_failed: true });
    else if (outcome === 'reject') delivery.reject({ condition: 'test:rejected', description: 'by the test' });
    else fail('usage', `unknown outcome ${outcome}`);
    if (n === outcomes.length) context.connection.close();
});
container.on('receiver_error', (context) => fail('link', context.receiver.error));
container.on('connection_error', (context) => fail('connection', context.connection.error));
container.on('disconnected', (context) => { if (n < outcomes.length) fail('disconnected', context.error); });
container.connect({ host: '127.0.0.1', port: Number(port), reconnect: false })
    .open_receiver({ source: address, autoaccept: false, credit_window: 1 });
