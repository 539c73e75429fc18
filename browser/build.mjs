// Bundle the browser worker into backbone/static/worker/ (gitignored; `make install` runs this).
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { compileWat } from "./src/wat.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "backbone", "static", "worker");
mkdirSync(out, { recursive: true });
// `import bytes from "./x.wat"`: the module assembled by wabt, as base64 text in the bundle.
const wat = { name: "wat", setup(b) {
  b.onResolve({ filter: /\.wat$/ }, (a) => ({ path: join(a.resolveDir, a.path), namespace: "wat" }));
  b.onLoad({ filter: /.*/, namespace: "wat" }, async (a) => ({
    contents: `export default ${JSON.stringify(Buffer.from(await compileWat(a.path)).toString("base64"))};`, loader: "js" }));
} };
await build({ entryPoints: [join(here, "src", "worker.js")], bundle: true, format: "iife", target: "es2020", plugins: [wat],
  outfile: join(out, "worker.js"), minify: false, legalComments: "inline", logLevel: "warning" });
await build({ entryPoints: [join(here, "src", "kernel.js")], bundle: true, format: "esm", target: "es2020",
  outfile: join(out, "kernel.mjs"), logLevel: "warning" });
copyFileSync(join(here, "index.html"), join(out, "index.html"));
console.error(`browser worker built into ${out}`);
