#!/usr/bin/env python3
"""The support console (docs/console.md) in a real browser: Debian's chromium, headless,
driven by Selenium through Debian's chromedriver, against `serve --console` started here
with a token file. Looks a customer up, reads the explanation, sees a refund on the
timeline, grants by hand and sees the change, and has a wrong token refused. Talks to
loopback only; stops only the server it started, by pid.

    python3 Tests/console/test_console.py .build/debug/entitlements"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "storeharness"))
from harness import FAILURES, check, post  # noqa: E402

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WRITE_TOKEN = "w" * 40
CHECK_TOKEN = "c" * 40
DAY = 86_400_000


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(admin_port, server):
    deadline = time.time() + 60
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit("serve exited with %s" % server.returncode)
        try:
            if urllib.request.urlopen("http://127.0.0.1:%d/readyz" % admin_port, timeout=2).status == 200:
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def write(door_port, method, body):
    status, answer = post(door_port, "/entitlements.v1.EntitlementService/" + method, body, {"Authorization": "Bearer " + WRITE_TOKEN})
    if status != 200:
        raise SystemExit("%s: %s %s" % (method, status, answer))
    return answer


def main():
    binary = os.path.abspath(sys.argv[1])
    work = tempfile.mkdtemp(prefix="console-test-")
    with open(work + "/tokens", "w") as f:
        f.write("# support engineers\n%s check,write\n# dashboards\n%s check\n" % (WRITE_TOKEN, CHECK_TOKEN))
    subprocess.run([binary, "snapshot", "generate", "--customers", "10", "--seed", "1", "--output", work + "/seed.snap"], check=True, capture_output=True)
    listen, door, admin = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [binary, "serve", "--data-dir", work + "/data", "--snapshot", work + "/seed.snap", "--listen", "127.0.0.1:%d" % listen,
         "--grpc-listen", "127.0.0.1:%d" % door, "--admin", "127.0.0.1:%d" % admin, "--console", "--auth-token-file", work + "/tokens"],
        stdout=open(work + "/serve.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    driver = None
    try:
        wait_ready(admin, server)
        now = int(time.time() * 1000)
        # alice bought a year of premium a month ago, and was refunded yesterday.
        purchase = {"transactionId": "t-1", "originalTransactionId": "t-1", "store": "SOURCE_APPSTORE",
                    "productId": "com.example.premium.annual", "transactionDate": str(now - 30 * DAY),
                    "expirationDate": str(now + 335 * DAY), "environment": "ENVIRONMENT_PRODUCTION", "type": "TRANSACTION_TYPE_SUBSCRIPTION_STARTED"}
        write(door, "RecordTransaction", {"userId": "alice", "transaction": purchase})
        refunded = dict(purchase, revocationDate=str(now - DAY))
        write(door, "RecordTransaction", {"userId": "alice", "transaction": refunded})
        write(door, "LinkAlias", {"userId": "alice", "alias": "anon-alice"})

        # The page and its assets come from the server, with no outside source allowed.
        page = urllib.request.urlopen("http://127.0.0.1:%d/console" % admin, timeout=5)
        html = page.read().decode()
        check("default-src 'self'" in page.headers.get("content-security-policy", ""), "the console page allows loading only from the admin listener")
        check("http" not in html.replace("http-equiv", "").split("<body>")[0].replace("/console/", ""), "the page's head loads nothing from another host")
        check(urllib.request.urlopen("http://127.0.0.1:%d/console/console.js" % admin, timeout=5).status == 200, "the script is served from the binary")

        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--user-data-dir=" + work + "/chrome"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.set_page_load_timeout(30)
        # The console re-renders its tables when an answer arrives: an element found just
        # before is then stale, and the wait tries again (it failed the test once in CI).
        wait = WebDriverWait(driver, 20, ignored_exceptions=[StaleElementReferenceException])
        driver.get("http://127.0.0.1:%d/console" % admin)

        def look_up(user, token):
            field = driver.find_element(By.ID, "token")
            field.clear()
            field.send_keys(token)
            user_field = driver.find_element(By.ID, "user")
            user_field.clear()
            user_field.send_keys(user)
            driver.find_element(By.CSS_SELECTOR, "#lookup button").click()

        # A wrong token is refused, and the page says so.
        look_up("alice", "not-a-token-at-all-0123456789")
        wait.until(expected_conditions.visibility_of_element_located((By.ID, "error")))
        error = driver.find_element(By.ID, "error").text
        check("401" in error and "unauthenticated" in error, "a wrong token is refused (401 unauthenticated): " + error)
        check(not driver.find_element(By.ID, "customer").is_displayed(), "nothing of the customer is shown to a wrong token")

        # Look up by alias with a check token: entitlements, explanation, history, timeline.
        look_up("anon-alice", CHECK_TOKEN)
        wait.until(expected_conditions.visibility_of_element_located((By.ID, "customer")))
        check("anon-alice (customer alice)" in driver.find_element(By.ID, "title").text, "the alias is looked up as its customer")
        rows = driver.find_elements(By.CSS_SELECTOR, "#entitlements tbody tr")
        check(any("premium" in r.text and "no" in r.text for r in rows), "premium is shown inactive (refunded)")
        explain = driver.find_element(By.ID, "explain").text
        check("premium" in explain and "revoked" in explain and "rule 2" in explain, "the explanation says premium was revoked, by rule 2")
        history = driver.find_element(By.ID, "history").text
        check("refunded" in history and "RecordTransaction by grpc token" in history, "the history shows the refund and who wrote it")
        refunds = driver.find_elements(By.CSS_SELECTOR, "#timeline svg circle.mark.refund")
        purchases = driver.find_elements(By.CSS_SELECTOR, "#timeline svg circle.mark.purchase")
        bars = driver.find_elements(By.CSS_SELECTOR, "#timeline svg rect.bar.active[data-entitlement='premium']")
        check(len(refunds) == 1 and len(purchases) == 1, "the timeline marks the purchase and the refund (%d, %d)" % (len(purchases), len(refunds)))
        check(len(bars) == 1, "the timeline has one bar for the time premium was active, before the refund (%d)" % len(bars))

        # A check token cannot grant; the page says why.
        driver.find_element(By.ID, "grant-entitlement").send_keys("premium")
        driver.find_element(By.ID, "grant-id").send_keys("goodwill-1")
        driver.find_element(By.ID, "grant-reason").send_keys("refund by mistake")
        driver.find_element(By.CSS_SELECTOR, "#grant button").click()
        wait.until(lambda d: d.find_element(By.ID, "write-result").text != "")
        result = driver.find_element(By.ID, "write-result").text
        check("403" in result and "permission_denied" in result, "a check token is refused a grant (403): " + result)

        # With the write token the grant goes through and the page shows premium active.
        token = driver.find_element(By.ID, "token")
        token.clear()
        token.send_keys(WRITE_TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#grant button").click()
        wait.until(lambda d: "GrantEntitlement: done" in d.find_element(By.ID, "write-result").text)
        wait.until(lambda d: any("premium" in r.text and "yes" in r.text for r in d.find_elements(By.CSS_SELECTOR, "#entitlements tbody tr")))
        check(True, "after the grant, premium is shown active")
        history = driver.find_element(By.ID, "history").text
        check("grant goodwill-1 of premium given" in history and "GrantEntitlement by admin token" in history, "the grant is in the history, written through the console's listener")
        check(len(driver.find_elements(By.CSS_SELECTOR, "#timeline svg circle.mark.grant")) == 1, "the timeline marks the grant")
        shown = json.loads(driver.execute_script("return document.getElementById('check-json').textContent"))
        check(shown["entitlements"]["premium"]["isActive"] is True and shown["entitlements"]["premium"]["grantType"] is not None,
              "the entitlements are there as check --json has them")

        # Revoked by hand: premium inactive again, the revocation marked.
        driver.find_element(By.ID, "revoke-id").send_keys("goodwill-1")
        driver.find_element(By.CSS_SELECTOR, "#revoke button").click()
        wait.until(lambda d: "RevokeGrant: done" in d.find_element(By.ID, "write-result").text)
        wait.until(lambda d: any("premium" in r.text and " no " in " " + r.text + " " for r in d.find_elements(By.CSS_SELECTOR, "#entitlements tbody tr")))
        check(len(driver.find_elements(By.CSS_SELECTOR, "#timeline svg circle.mark.revoke")) == 1, "after the revocation, premium is inactive and the timeline marks it")

        if os.environ.get("CONSOLE_SCREENSHOT"):  # to look at the page: CONSOLE_SCREENSHOT=/tmp/console.png
            driver.set_window_size(1000, 1800)
            driver.save_screenshot(os.environ["CONSOLE_SCREENSHOT"])

        # The same history through the door, as any client sees it.
        status, answer = post(door, "/entitlements.v1.EntitlementService/CustomerHistory", {"userId": "anon-alice"}, {"Authorization": "Bearer " + CHECK_TOKEN})
        causes = [e["cause"] for e in answer["entries"]] if status == 200 else []
        check(status == 200 and causes == ["write"] * 5, "CustomerHistory over the JSON door: five writes (%s %s)" % (status, causes))
        status, _ = post(admin, "/console/api/Compact", {}, {"Authorization": "Bearer " + WRITE_TOKEN})
        check(status == 404, "the console calls only its own methods (Compact is 404: %s)" % status)
        # Another site's page cannot make a browser call the console: a form post (text/plain,
        # no preflight) is refused, and so is a call a browser says comes from elsewhere.
        grant = {"userId": "alice", "grant": {"grantId": "csrf", "entitlementId": "premium"}}
        status, _ = post(admin, "/console/api/GrantEntitlement", json.dumps(grant).encode(), {"Content-Type": "text/plain", "Authorization": "Bearer " + WRITE_TOKEN})
        check(status == 400, "a cross-site form post (text/plain) is refused (%s)" % status)
        status, _ = post(admin, "/console/api/GrantEntitlement", grant, {"Origin": "http://evil.example", "Authorization": "Bearer " + WRITE_TOKEN})
        check(status == 403, "a call from another origin is refused (%s)" % status)
        status, _ = post(admin, "/console/api/GrantEntitlement", grant, {"Sec-Fetch-Site": "cross-site", "Authorization": "Bearer " + WRITE_TOKEN})
        check(status == 403, "a call the browser says is cross-site is refused (%s)" % status)
        status, answer = post(door, "/entitlements.v1.EntitlementService/CustomerHistory", {"userId": "alice"}, {"Authorization": "Bearer " + CHECK_TOKEN})
        check(status == 200 and not any("csrf" in e["summary"] for e in answer["entries"]), "none of them wrote anything")
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    if FAILURES:
        print("console: %d failed" % len(FAILURES))
        print(open(work + "/serve.log").read()[-3000:])
        sys.exit(1)
    print("console: all passed")


if __name__ == "__main__":
    main()
