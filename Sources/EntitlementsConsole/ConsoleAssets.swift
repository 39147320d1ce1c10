/// The console's page, script and style, served from the binary (no CDN, no framework):
/// plain HTML, one script that calls `/console/api/<Method>`, and a style sheet. Data from
/// the server is only ever put in the page as text (`textContent`), never as markup.
enum ConsoleAssets {
    static let html = #"""
    <!doctype html>
    <html lang="en">
    <head>
    <meta charset="utf-8">
    <meta name="viewport" content="width=device-width, initial-scale=1">
    <title>Entitlements console</title>
    <link rel="stylesheet" href="/console/console.css">
    <script src="/console/console.js" defer></script>
    </head>
    <body>
    <header>
      <h1>Entitlements console</h1>
      <label>Token <input id="token" type="password" autocomplete="off" spellcheck="false" placeholder="bearer token"></label>
    </header>
    <main>
      <form id="lookup">
        <input id="user" name="user" placeholder="customer id or alias" required autocomplete="off" spellcheck="false">
        <button type="submit">Look up</button>
      </form>
      <div id="error" role="alert" hidden></div>
      <section id="customer" hidden>
        <h2 id="title"></h2>
        <p id="summary"></p>
        <h3>Entitlements now</h3>
        <table id="entitlements"><thead><tr><th>entitlement</th><th>active</th><th>source</th><th>product</th><th>expires</th><th>renew state</th><th>status</th></tr></thead><tbody></tbody></table>
        <details><summary>as <code>check --json</code> has them</summary><pre id="check-json"></pre></details>
        <h3>Timeline</h3>
        <div id="timeline"></div>
        <p class="legend"><span class="key active"></span> active <span class="key grace"></span> in grace period
          <span class="key purchase"></span> purchase <span class="key renewal"></span> renewal <span class="key refund"></span> refund
          <span class="key grant"></span> grant <span class="key revoke"></span> revoked <span class="key write"></span> other write</p>
        <h3>Why</h3>
        <pre id="explain"></pre>
        <h3>History</h3>
        <p id="reach"></p>
        <ol id="history"></ol>
        <h3>Grant or revoke by hand</h3>
        <p class="note">Needs a token with the write permission.</p>
        <form id="grant">
          <input id="grant-entitlement" placeholder="entitlement" required>
          <input id="grant-id" placeholder="grant id" required>
          <label>until <input id="grant-expires" type="datetime-local"></label>
          <input id="grant-reason" placeholder="reason">
          <button type="submit">Grant</button>
        </form>
        <form id="revoke">
          <input id="revoke-id" placeholder="grant id" required>
          <button type="submit">Revoke</button>
        </form>
        <div id="write-result" role="status"></div>
      </section>
    </main>
    </body>
    </html>
    """#

    static let script = #"""
    'use strict';
    (function () {
      const $ = (id) => document.getElementById(id);
      const svgNS = 'http://www.w3.org/2000/svg';
      let currentUser = null;

      // One call of the service, as the JSON door takes it, with the token typed above.
      async function call(method, body) {
        const headers = { 'content-type': 'application/json' };
        const token = $('token').value.trim();
        if (token) headers.authorization = 'Bearer ' + token;
        const response = await fetch('/console/api/' + method, {
          method: 'POST', headers: headers, body: JSON.stringify(body), credentials: 'omit', cache: 'no-store'
        });
        const text = await response.text();
        let json;
        try { json = JSON.parse(text); } catch (e) { json = { message: text }; }
        if (!response.ok) {
          throw new Error(method + ' refused (HTTP ' + response.status + '): ' + (json.code ? json.code + ': ' : '') + (json.message || ''));
        }
        return json;
      }

      function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
      function element(tag, text, className) {
        const node = document.createElement(tag);
        if (text !== undefined && text !== null) node.textContent = String(text);
        if (className) node.className = className;
        return node;
      }
      function showError(message) { $('error').textContent = message || ''; $('error').hidden = !message; }

      async function lookUp(user, minLogSequence) {
        showError('');
        const request = { userId: user, explain: true };
        if (minLogSequence) request.minLogSequence = String(minLogSequence);
        try {
          const check = await call('CheckEntitlements', request);
          const history = await call('CustomerHistory', { userId: user });
          currentUser = user;
          render(user, check, history);
        } catch (error) {
          $('customer').hidden = true;
          showError(error.message);
        }
      }

      function render(user, check, history) {
        $('customer').hidden = false;
        const customer = history.customerId;
        $('title').textContent = customer ? (customer === user ? customer : user + ' (customer ' + customer + ')') : user + ' (no customer by this id)';
        const active = Object.values(check.entitlements).filter((e) => e.isActive).map((e) => e.id);
        $('summary').textContent = 'Active now: ' + (active.length ? active.join(', ') : 'nothing') + '. Answer valid until ' + (check.validUntil || 'it changes by a write') + '.';
        renderEntitlements(check);
        const plain = Object.assign({}, check);
        delete plain.explanation;
        $('check-json').textContent = JSON.stringify(plain, null, 2);
        renderTimeline(history);
        renderExplanation(check.explanation);
        renderHistory(history);
      }

      function renderEntitlements(check) {
        const body = $('entitlements').tBodies[0];
        clear(body);
        for (const e of Object.values(check.entitlements)) {
          const row = element('tr', null, e.isActive ? 'active' : 'inactive');
          for (const value of [e.id, e.isActive ? 'yes' : 'no', e.source, e.productId, e.expirationDate || 'never', e.renewState, e.status]) {
            row.appendChild(element('td', value === null || value === undefined ? '-' : value));
          }
          body.appendChild(row);
        }
        if (!body.rows.length) {
          const row = element('tr');
          const cell = element('td', 'no entitlements');
          cell.colSpan = 7;
          row.appendChild(cell);
          body.appendChild(row);
        }
      }

      function renderExplanation(explanation) {
        const lines = [];
        for (const e of (explanation && explanation.entitlements) || []) {
          lines.push(e.entitlementId + ': ' + e.decision);
          for (const c of e.candidates) {
            const mark = c.won ? 'won ' : (c.isActive ? 'active' : (c.counted ? 'lost ' : 'not counted'));
            lines.push('  [' + mark + '] ' + c.kind + ' ' + c.id + (c.productId ? ' (' + c.productId + ')' : '') + ': ' + c.reason);
          }
        }
        if (explanation && explanation.validUntilFrom) lines.push('valid until: ' + explanation.validUntilFrom);
        if (explanation) lines.push('read at log sequence ' + explanation.logSequence + ', snapshot ' + explanation.snapshotId);
        $('explain').textContent = lines.length ? lines.join('\n') : 'nothing to explain';
      }

      function kind(entry) {
        const s = entry.summary || '';
        if (entry.cause !== 'write') return null;
        if (/refunded/.test(s)) return 'refund';
        if (/revoked/.test(s)) return 'revoke';
        if (/ recorded: .*\(chain /.test(s)) return 'renewal';
        if (/ recorded: /.test(s)) return 'purchase';
        if (/grant .* given/.test(s)) return 'grant';
        return 'write';
      }

      function renderHistory(history) {
        $('reach').textContent = (history.startsAfterLogSequence > 0
          ? 'From the state kept at log sequence ' + history.startsAfterLogSequence + ' (' + history.startsDate + '); earlier writes are folded into it.'
          : 'Every write since the server\'s data began.') + (history.truncated ? ' Only the latest entries are shown.' : '');
        const list = $('history');
        clear(list);
        for (const entry of history.entries) {
          const item = element('li', null, entry.cause);
          item.appendChild(element('time', entry.date));
          let what = entry.cause === 'write' ? ' write ' + entry.logSequence : (entry.cause === 'time' ? ' time' : ' start');
          if (entry.source) {
            what += ' ' + [entry.source.method, entry.source.caller ? 'by ' + entry.source.caller : null, entry.source.eventId ? 'event ' + entry.source.eventId : null].filter(Boolean).join(' ');
          }
          item.appendChild(element('span', what, 'cause'));
          item.appendChild(element('div', entry.summary, 'what'));
          const active = Object.values(entry.entitlements).filter((e) => e.isActive).map((e) => e.id);
          item.appendChild(element('div', entry.deleted ? 'customer deleted' : 'active after: ' + (active.length ? active.join(', ') : 'none'), 'after'));
          list.appendChild(item);
        }
      }

      function svg(tag, attributes, parent) {
        const node = document.createElementNS(svgNS, tag);
        for (const key of Object.keys(attributes)) node.setAttribute(key, attributes[key]);
        if (parent) parent.appendChild(node);
        return node;
      }

      // Access per entitlement over time: a bar for each period it was active (amber in a
      // grace period), and a mark for each write on the line above, by kind.
      function renderTimeline(history) {
        const box = $('timeline');
        clear(box);
        const entries = history.entries;
        if (!entries.length) { box.textContent = 'nothing happened to this customer'; return; }
        const start = Date.parse(entries[0].date);
        const end = Math.max(Date.now(), Date.parse(entries[entries.length - 1].date) + 1);
        const ids = [];
        for (const entry of entries) for (const id of Object.keys(entry.entitlements)) if (!ids.includes(id)) ids.push(id);
        ids.sort();
        const width = 900, label = 120, row = 26, top = 52;
        const x = (t) => label + (width - label - 10) * (t - start) / Math.max(1, end - start);
        const chart = svg('svg', { width: width, height: top + row * ids.length + 24, role: 'img', 'aria-label': 'timeline' }, box);
        svg('line', { x1: label, x2: width - 10, y1: top - 6, y2: top - 6, class: 'axis' }, chart);
        ids.forEach((id, index) => {
          const y = top + row * index;
          svg('text', { x: 4, y: y + 16, class: 'label' }, chart).textContent = id;
          for (let i = 0; i < entries.length; i++) {
            const state = entries[i].entitlements[id];
            if (!state || !state.isActive) continue;
            const from = Date.parse(entries[i].date);
            const to = i + 1 < entries.length ? Date.parse(entries[i + 1].date) : end;
            const bar = svg('rect', {
              x: x(from), y: y + 4, width: Math.max(2, x(to) - x(from)), height: row - 8,
              class: 'bar ' + (state.isInGracePeriod ? 'grace' : 'active'), 'data-entitlement': id
            }, chart);
            svg('title', {}, bar).textContent = id + ' ' + (state.isInGracePeriod ? 'in grace period' : 'active') + ' from ' + entries[i].date + (i + 1 < entries.length ? ' to ' + entries[i + 1].date : ' on');
          }
        });
        // Writes close together (a purchase and its refund in one minute) stack upwards.
        const placed = [];
        for (const entry of entries) {
          const k = kind(entry);
          if (!k) continue;
          const cx = x(Date.parse(entry.date));
          const level = Math.min(3, placed.filter((p) => Math.abs(p - cx) < 9).length);
          placed.push(cx);
          const mark = svg('circle', { cx: cx, cy: top - 14 - 11 * level, r: 5, class: 'mark ' + k, 'data-sequence': entry.logSequence }, chart);
          svg('title', {}, mark).textContent = entry.date + ' ' + entry.summary;
        }
        svg('text', { x: label, y: top + row * ids.length + 18, class: 'tick' }, chart).textContent = entries[0].date;
        svg('text', { x: width - 10, y: top + row * ids.length + 18, class: 'tick end' }, chart).textContent = new Date(end).toISOString();
      }

      async function write(method, body) {
        $('write-result').textContent = '';
        try {
          const answer = await call(method, body);
          $('write-result').textContent = method + ': ' + (answer.changed ? 'done' : 'nothing to change') + (answer.logSequence ? ', log sequence ' + answer.logSequence : '');
          await lookUp(currentUser, answer.logSequence);
        } catch (error) {
          $('write-result').textContent = error.message;
        }
      }

      document.addEventListener('DOMContentLoaded', () => {
        $('lookup').addEventListener('submit', (event) => { event.preventDefault(); lookUp($('user').value.trim()); });
        $('grant').addEventListener('submit', (event) => {
          event.preventDefault();
          const grant = { grantId: $('grant-id').value.trim(), entitlementId: $('grant-entitlement').value.trim() };
          const expires = $('grant-expires').value;
          if (expires) grant.expirationDate = String(Date.parse(expires));
          const reason = $('grant-reason').value.trim();
          if (reason) grant.reason = reason;
          write('GrantEntitlement', { userId: currentUser, grant: grant });
        });
        $('revoke').addEventListener('submit', (event) => {
          event.preventDefault();
          write('RevokeGrant', { userId: currentUser, grantId: $('revoke-id').value.trim() });
        });
      });
    })();
    """#

    static let style = #"""
    body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1b1f24; }
    header { display: flex; justify-content: space-between; align-items: center; padding: 8px 16px; background: #24292f; color: #fff; }
    header h1 { font-size: 18px; margin: 0; }
    header input { width: 22em; }
    main { padding: 12px 16px; max-width: 960px; }
    form { margin: 8px 0; display: flex; gap: 6px; flex-wrap: wrap; align-items: center; }
    input { padding: 4px 6px; border: 1px solid #8c959f; border-radius: 4px; }
    button { padding: 4px 12px; border-radius: 4px; border: 1px solid #1f6feb; background: #1f6feb; color: #fff; cursor: pointer; }
    #error { background: #ffebe9; border: 1px solid #cf222e; color: #82071e; padding: 8px; border-radius: 4px; }
    table { border-collapse: collapse; }
    th, td { text-align: left; padding: 3px 10px 3px 0; border-bottom: 1px solid #d0d7de; }
    tr.active td:first-child { font-weight: 600; }
    pre { background: #f6f8fa; padding: 8px; white-space: pre-wrap; overflow-wrap: anywhere; }
    ol#history li { margin-bottom: 6px; }
    ol#history time { font-family: ui-monospace, monospace; }
    ol#history .cause { color: #57606a; }
    ol#history li.time .what { color: #9a6700; }
    .after { color: #57606a; }
    .note { color: #57606a; margin: 0; }
    svg .axis { stroke: #8c959f; }
    svg .label, svg .tick { font-size: 12px; fill: #1b1f24; }
    svg .tick.end { text-anchor: end; }
    svg .bar.active, .key.active { fill: #2da44e; background: #2da44e; }
    svg .bar.grace, .key.grace { fill: #d4a72c; background: #d4a72c; }
    svg .mark { stroke: #fff; stroke-width: 1; }
    .mark.purchase, .key.purchase { fill: #0969da; background: #0969da; }
    .mark.renewal, .key.renewal { fill: #54aeff; background: #54aeff; }
    .mark.refund, .key.refund { fill: #cf222e; background: #cf222e; }
    .mark.grant, .key.grant { fill: #8250df; background: #8250df; }
    .mark.revoke, .key.revoke { fill: #953800; background: #953800; }
    .mark.write, .key.write { fill: #6e7781; background: #6e7781; }
    .legend .key { display: inline-block; width: 12px; height: 12px; border-radius: 2px; vertical-align: middle; margin-left: 8px; }
    """#
}
