// The Node.js side of dsec's JavaScript kernel (see jskernel.py).
//
// Reads one JSON request per line on stdin ({"code": "..."}), runs it in this process's
// global context (so top-level declarations persist from cell to cell, as in a browser's
// <script> tags), and answers one JSON line on the file descriptor named by
// DSEC_JS_CTL_FD: {"ok": true, "result": <util.inspect of the value> | null} or
// {"ok": false, "ename", "evalue", "traceback": [lines]}. console output goes to stdout and
// stderr, which are pipes (written synchronously on Linux, so it is all in the pipe before
// the answer). A value that is a Promise is awaited. A cell with top-level `await` runs as
// an async function; its simple `const/let/var name = ...` declarations become globals.
'use strict';
const fs = require('fs');
const util = require('util');
const vm = require('vm');
const Module = require('module');
const readline = require('readline');

const ctlFd = Number(process.env.DSEC_JS_CTL_FD);
delete process.env.DSEC_JS_CTL_FD;
let pending = null;

globalThis.require = Module.createRequire(process.cwd() + '/');
process.on('SIGINT', () => {
  if (pending) pending(new Error('Script execution interrupted.'));
});
process.on('unhandledRejection', (reason) => {
  process.stderr.write('Unhandled promise rejection: ' + util.inspect(reason) + '\n');
});

function answer(obj) {
  fs.writeSync(ctlFd, JSON.stringify(obj) + '\n');
}

// The stack without this kernel's own frames (they follow the user's cell frames).
function userStack(stack) {
  const lines = String(stack).split('\n');
  const cut = lines.findIndex((l, i) => i > 0 && /node:vm|jskernel\.js|sigintHandlersWrap/.test(l));
  return cut > 0 ? lines.slice(0, cut) : lines;
}

function failure(err) {
  if (err instanceof Error || (err && typeof err === 'object' && 'stack' in err)) {
    return {ok: false, ename: String(err.name || 'Error'), evalue: String(err.message || ''),
            traceback: userStack(err.stack || err)};
  }
  return {ok: false, ename: 'Error', evalue: util.inspect(err), traceback: []};
}

function asyncWrapper(code) {
  const lines = code.replace(/\s+$/, '').split('\n').map((line) =>
    line.replace(/^(\s*)(?:const|let|var)\s+([A-Za-z_$][\w$]*)\s*=/, '$1globalThis.$2 ='));
  const last = lines.length - 1;
  const tail = lines[last];
  if (!/^\s*(const|let|var|function|class|if|for|while|do|switch|try|return|throw|\}|\/\/)/.test(tail)
      && !/[{;]\s*$/.test(tail.replace(/;\s*$/, '')) && tail.trim()) {
    lines[last] = 'return (' + tail.replace(/;\s*$/, '') + ');';
  }
  return '(async () => {\n' + lines.join('\n') + '\n})()';
}

function compile(code) {
  try {
    return new vm.Script(code, {filename: 'cell.js'});
  } catch (err) {
    if (err instanceof SyntaxError && /await is only valid|Unexpected reserved word/.test(err.message)) {
      return new vm.Script(asyncWrapper(code), {filename: 'cell.js'});
    }
    throw err;
  }
}

async function run(code) {
  let value = compile(code).runInThisContext({breakOnSigint: true, displayErrors: false});
  if (value && typeof value.then === 'function') {
    value = await new Promise((resolve, reject) => {
      pending = reject;
      value.then(resolve, reject);
    }).finally(() => { pending = null; });
  }
  return value === undefined ? null : util.inspect(value, {depth: 4, maxArrayLength: 1000});
}

const rl = readline.createInterface({input: process.stdin, terminal: false});
const queue = [];
let busy = false;
async function next() {
  if (busy || queue.length === 0) return;
  busy = true;
  const line = queue.shift();
  try {
    const {code} = JSON.parse(line);
    answer({ok: true, result: await run(code)});
  } catch (err) {
    answer(failure(err));
  }
  busy = false;
  next();
}
rl.on('line', (line) => { queue.push(line); next(); });
rl.on('close', () => process.exit(0));
