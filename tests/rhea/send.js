// Sends COUNT messages (bodies "r0", "r1", ...) to ADDRESS whenever rhea lets it (credit, and rhea's
// own window of unsettled deliveries), unsettled; closes once every one is accepted.
// Usage: node send.js PORT ADDRESS COUNT [USER PASSWORD]
// Prints one JSON object a line: {"sent": n} after each burst, {"accepted": n}, then {"done": n};
// {"error": "..."} and exit code 1 if the connection or the link fails.
'use strict';
const rhea = require('rhea');
const [port, address, count, user, password] = process.argv.slice(2);
const total = Number(count);
const report = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const fail = (what, error) => {
    report({ error: `${what}: ${error && (error.condition || error.message || error)}` +
             `${error && error.description ? ': ' + error.description : ''}` });
    process.exit(1);
};

const container = rhea.create_container({ id: 'rhea-send' });
let sent = 0;
let accepted = 0;
container.on('sendable', (context) => {
    const before = sent;
    while (context.sender.sendable() && sent < total) {
        context.sender.send({ body: `r${sent}`, message_id: `id-${sent}` });
        sent += 1;
    }
    if (sent > before) report({ sent });
});
container.on('accepted', (context) => {
    accepted += 1;
    report({ accepted });
    if (accepted === total) {
        report({ done: accepted });
        context.connection.close();
    }
});
container.on('rejected', (context) => fail('rejected', context.delivery.remote_state.error));
container.on('sender_error', (context) => fail('link', context.sender.error));
container.on('connection_error', (context) => fail('connection', context.connection.error));
container.on('disconnected', (context) => { if (accepted < total) fail('disconnected', context.error); });
const options = { host: '127.0.0.1', port: Number(port), reconnect: false };
if (user) Object.assign(options, { username: user, password });
container.connect(options).open_sender(address);
