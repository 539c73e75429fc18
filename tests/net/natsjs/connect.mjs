// nats.js (the NATS project's own client) as an outside client of a `kvasir creds init` file:
//   node connect.mjs URL CREDS_FILE SUBJECT [INBOX_PREFIX]
// Connects with the .creds file as it is, publishes one message on SUBJECT, round-trips a
// flush, and prints one JSON line: {"connected": true, "server": ..., "published": SUBJECT}.
// CREDS_FILE "-" connects anonymously. Any failure: {"connected": false, "error": ...}, exit 1.
import { readFileSync } from "node:fs";
import { connect, credsAuthenticator } from "@nats-io/transport-node";

const [url, credsFile, subject, inboxPrefix] = process.argv.slice(2);
const opts = { servers: url, reconnect: false, timeout: 3000 };
if (credsFile !== "-") opts.authenticator = credsAuthenticator(readFileSync(credsFile));
if (inboxPrefix) opts.inboxPrefix = inboxPrefix;
try {
  const nc = await connect(opts);
  nc.publish(subject, "from nats.js");
  await nc.flush();
  console.log(JSON.stringify({ connected: true, server: nc.info.server_id, published: subject }));
  await nc.close();
} catch (err) {
  console.log(JSON.stringify({ connected: false, error: String(err && err.message || err) }));
  process.exit(1);
}
