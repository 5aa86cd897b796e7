#!/usr/bin/python3
"""The operator console in a real browser (Chromium, driven by WebDriver).

Run by crates/meshd/tests/console_browser.rs against a running meshd cluster with
tokens (and a tokenless one); it prepares state through the public API, then checks
that every view shows what the API says, that actions taken in the page reach meshd,
and that a client token cannot press admin buttons. A screenshot of each view goes to
--shots. Exits non-zero naming the first check that failed.
"""

import argparse
import base64
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

WAIT = 20


class Api:
    def __init__(self, base, token):
        self.base, self.token = base, token

    def call(self, method, path, body=None, content_type="application/json"):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                text = r.read().decode()
                return r.status, (json.loads(text) if text else None)
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            return e.code, (json.loads(text) if text.startswith("{") else text)

    def ok(self, method, path, body=None, content_type="application/json"):
        status, answer = self.call(method, path, body, content_type)
        if status >= 300:
            raise AssertionError(f"{method} {path} answered {status}: {answer}")
        return answer


def event(i, **extra):
    e = {"specversion": "1.0", "id": f"order-{i}", "source": "/console-test", "type": "order.created", "data": {"n": i}}
    e.update(extra)
    return e


def publish(api, topic, e):
    return api.ok("POST", f"/v1/topics/{topic}/events", e, "application/cloudevents+json")


def eventually(what, check, timeout=WAIT):
    """Retries `check` until it returns a truthy value; fails naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            got = check()
            if got:
                return got
            last = got
        except (AssertionError, StaleElementReferenceException) as e:
            # A view re-renders on every poll: an element read a moment ago may be gone.
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last: {last})")
        time.sleep(0.2)


class Page:
    def __init__(self, driver, base, shots):
        self.d, self.base, self.shots = driver, base, shots

    def go(self, view):
        self.d.get(f"{self.base}/console/#/{view}")

    def css(self, selector):
        return self.d.find_elements(By.CSS_SELECTOR, selector)

    def one(self, selector, timeout=WAIT):
        try:
            return WebDriverWait(self.d, timeout).until(lambda d: d.find_element(By.CSS_SELECTOR, selector))
        except TimeoutException:
            raise AssertionError(f"no {selector!r} on {self.d.current_url}:\n{self.text()[:2000]}")

    def text(self):
        return self.d.find_element(By.TAG_NAME, "body").text

    def until(self, what, check, timeout=WAIT):
        return eventually(f"{what} ({self.d.current_url})", check, timeout)

    def shot(self, name):
        if self.shots:
            self.d.save_screenshot(f"{self.shots}/{name}.png")

    def sign_in(self, token):
        # From a fresh tab state: no token kept from an earlier sign-in.
        self.d.get(f"{self.base}/console/")
        self.d.execute_script("sessionStorage.clear()")
        self.d.get(f"{self.base}/console/")
        box = self.one("#token")
        box.clear()
        box.send_keys(token + Keys.ENTER)

    def sign_out(self):
        self.one("#signout").click()
        self.one("#token")

    def rows(self, table):
        """The cells' text of a table, read at once (views re-render as they poll)."""
        return self.d.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(tr => [...tr.cells].map(td => td.innerText.trim()))",
            f"table[data-test={table}] tbody tr")

    def attrs(self, selector, name):
        """An attribute of every element matching `selector`, read at once."""
        return self.d.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))", selector, name)


def prepare(admin):
    admin.ok("PUT", "/v1/topics/orders", {"partitions": 6})
    admin.ok("PUT", "/v1/subscriptions/billing", {"topic": "orders", "start": "earliest"})
    admin.ok("PUT", "/v1/subscriptions/poison", {"topic": "orders", "start": "earliest", "max_attempts": 1})
    for i in range(12):
        publish(admin, "orders", event(i))
    publish(admin, "orders", {"specversion": "1.0", "id": "order-binary", "source": "/console-test", "type": "order.blob",
                              "datacontenttype": "application/octet-stream", "data_base64": base64.b64encode(b"\x00\x01\xfe").decode()})
    # Every event of `poison` fails its only attempt: 13 dead letters.
    nacked = set()

    def nack_all():
        got = admin.ok("POST", "/v1/subscriptions/poison/pull", {"max_events": 100, "wait_ms": 500})["deliveries"]
        if got:
            admin.ok("POST", "/v1/subscriptions/poison/nack", {"delivery_ids": [d["delivery_id"] for d in got], "reason": "cannot parse order"})
            nacked.update(d["event"]["id"] for d in got)
        return len(nacked) == 13
    eventually("every poison event nacked", nack_all)
    eventually("13 dead letters", lambda: len(admin.ok("GET", "/v1/deadletters?subscription=poison")["entries"]) == 13)
    # billing: half acked.
    acked = set()

    def ack_some():
        got = admin.ok("POST", "/v1/subscriptions/billing/pull", {"max_events": 100, "wait_ms": 500})["deliveries"]
        keep = [d for d in got if d["event"]["id"] not in acked]
        admin.ok("POST", "/v1/subscriptions/billing/ack", {"delivery_ids": [d["delivery_id"] for d in keep]})
        acked.update(d["event"]["id"] for d in keep)
        return len(acked) == 13
    eventually("billing acked", ack_some)
    # Tasks and a session.
    for i in range(3):
        admin.ok("POST", "/v1/tasks", {"id": f"summary-{i}", "agent": "summarizer", "input": {"doc": i}})
    session = admin.ok("POST", "/v1/sessions", {"client_id": "summarizer", "ttl_ms": 120000})
    admin.ok("POST", "/v1/tasks/summary-0/claim", {"session": session["session_id"]})
    return session


def check_cluster(p, admin):
    p.go("cluster")
    c = admin.ok("GET", "/v1/cluster")
    p.one("table[data-test=members]")
    members = sorted(m["instance"] for m in c["members"])
    p.until("the members the API lists", lambda: sorted(r[0].replace(" (this one)", "") for r in p.rows("members")) == members)

    def owners_match():
        c = admin.ok("GET", "/v1/cluster")
        want = {str(x["partition"]): x["owner"] for x in c["partitions"] if x["topic"] == "orders"}
        got = dict(zip(p.attrs("ul[data-test=grid-orders] li", "data-partition"), p.attrs("ul[data-test=grid-orders] li", "data-owner")))
        return got == want and all(want.values())
    p.until("every partition of orders coloured by the owner the API names", owners_match)
    assert "healthy" in p.one("[data-test=meta]").text
    p.one("svg[data-test=timeline]")
    p.shot("cluster")


def check_topics(p, admin):
    p.go("topics")
    t = admin.ok("GET", "/v1/topics/orders")
    p.one("table[data-test=topics]")
    row = p.until("the orders row", lambda: next((r for r in p.rows("topics") if r and r[0] == "orders"), None))
    assert row[1] == "6", row
    assert row[3].replace(",", "") == str(sum(t["end_offsets"])), (row, t)
    # The publish rate comes alive: publish while the page watches.
    for i in range(20):
        publish(admin, "orders", event(100 + i))
    p.until("a publish rate above zero", lambda: any(float(r[4]) > 0 for r in p.rows("topics") if r and r[0] == "orders" and r[4] not in ("–", "")))
    p.shot("topics")


def check_subscriptions(p, admin):
    p.go("subscriptions")
    p.one("table[data-test=subscriptions]")
    p.until("both subscriptions listed", lambda: {"billing", "poison"} <= {r[0] for r in p.rows("subscriptions")})
    p.go("subscriptions?name=billing")
    p.one("table[data-test=stats]")

    def stats_match():
        want = {str(x["partition"]): (str(x["committed"]), str(x["backlog"])) for x in admin.ok("GET", "/v1/subscriptions/billing/stats")["partitions"]}
        got = {r[0]: (r[1].replace(",", ""), r[3].replace(",", "")) for r in p.rows("stats")}
        return got == want
    p.until("billing's stats as the API answers them", stats_match)
    # An offset reset shows what it redelivers; cancel changes nothing, confirm resets.
    stats = admin.ok("GET", "/v1/subscriptions/billing/stats")["partitions"]
    part = max(stats, key=lambda x: x["committed"])
    assert part["committed"] > 0, stats
    p.until("the partition choice", lambda: str(part["partition"]) in p.attrs("#reset-partition option", "value"))
    Select(p.one("#reset-partition")).select_by_value(str(part["partition"]))
    p.one("#reset-offset").send_keys("0")
    p.one("[data-test=reset-button]").click()
    what = p.one("dialog[open] [data-test=reset-what]").text
    n = part["committed"]
    expect = f"Events 0 to {n - 1} of partition {part['partition']} ({n} events) will be delivered again to billing"
    assert expect in what, (what, expect)
    p.shot("subscription-reset")
    p.one("dialog[open] [data-test=cancel]").click()
    assert admin.ok("GET", "/v1/subscriptions/billing/offsets")["offsets"][part["partition"]]["committed"] == n
    p.one("[data-test=reset-button]").click()
    p.one("dialog[open] [data-test=confirm]").click()
    p.until("the reset applied in meshd", lambda: next(o for o in admin.ok("GET", "/v1/subscriptions/billing/offsets")["offsets"] if o["partition"] == part["partition"])["committed"] == 0)
    p.until("the page says so", lambda: "reset to 0" in p.one("[data-test=reset-result]").text)
    p.until("the stats show the backlog", stats_match)
    p.shot("subscription")


def check_deadletters(p, admin):
    p.go("deadletters?subscription=poison")
    p.one("table[data-test=deadletters]")
    want = {e["id"] for e in admin.ok("GET", "/v1/deadletters?subscription=poison")["entries"]}
    p.until("the poison entries the API lists", lambda: set(p.attrs("table[data-test=deadletters] tbody tr", "data-id")) == want)
    # The binary event, shown as bytes.
    entries = admin.ok("GET", "/v1/deadletters?subscription=poison")["entries"]
    binary = next(e for e in entries if e["event"]["id"] == "order-binary")
    p.one(f"button[data-test=view-entry][data-id='{binary['id']}']").click()
    p.until("the binary entry's size", lambda: p.one("[data-test=binary-size]").text.startswith("3 bytes"))
    assert "00 01 fe" in p.one("[data-test=hexdump]").text
    assert p.one("[data-test=entry-reason]").text == "cannot parse order"
    p.shot("deadletters")
    # Redrive one from the page, then see it delivered to poison.
    target = next(e for e in entries if e["event"]["id"] == "order-3")
    p.one(f"button[data-test=view-entry][data-id='{target['id']}']").click()
    p.until("order-3's entry", lambda: "order-3" in p.one("[data-test=event-json]").text)
    p.one("[data-test=redrive-one]").click()
    p.until("the redrive reported", lambda: "Redrive: 1 of 1 done" in p.one("[data-test=dl-status]").text)

    # (poison also gets what the topics check published since: acked on the way.)
    seen = []

    def delivered():
        got = admin.ok("POST", "/v1/subscriptions/poison/pull", {"max_events": 100, "wait_ms": 500})["deliveries"]
        if got:
            admin.ok("POST", "/v1/subscriptions/poison/ack", {"delivery_ids": [d["delivery_id"] for d in got]})
        seen.extend((d["event"]["id"], d["attempt"]) for d in got)
        return ("order-3", 1) in seen
    eventually("the redriven event delivered to poison", delivered)
    # Delete a selection of two.
    p.go("deadletters?subscription=poison")
    p.one("table[data-test=deadletters]")
    doomed = [e["id"] for e in entries if e["event"]["id"] in ("order-4", "order-5")]
    for i in doomed:
        p.until(f"the checkbox of {i}", lambda: p.css(f"input[type=checkbox][data-id='{i}']"))[0].click()
    assert p.one("[data-test=selected]").text == "2 selected"
    p.one("[data-test=delete-selected]").click()
    p.one("dialog[open] [data-test=confirm]").click()
    p.until("the deletion reported", lambda: "Delete: 2 of 2 done" in p.one("[data-test=dl-status]").text)
    left = {e["id"] for e in admin.ok("GET", "/v1/deadletters?subscription=poison")["entries"]}
    assert not set(doomed) & left, left


def check_tasks(p, admin):
    p.go("tasks?agent=summarizer")
    p.one("[data-test=board]")

    def board():
        tasks = admin.ok("GET", "/v1/tasks?agent=summarizer")["tasks"]
        for state in ("submitted", "working"):
            want = sorted(t["id"] for t in tasks if t["state"] == state)
            got = sorted(p.attrs(f"section[data-state={state}] button", "data-id"))
            if got != want:
                return False
        return True
    p.until("the board as the API lists the tasks", board)
    p.one("section[data-state=working] button[data-id='summary-0']").click()
    p.until("summary-0's history", lambda: [t.split(" ")[0] for t in p.attrs("[data-test=task-history] li strong", "data-state")] == ["submitted", "working"])
    p.shot("tasks")


def check_sessions(p, admin, session):
    p.go("sessions")
    p.one("table[data-test=sessions]")
    p.until("the live session", lambda: any(r[0] == "summarizer" and r[1] == session["session_id"] for r in p.rows("sessions")))
    p.shot("sessions")


def check_live(p, admin):
    p.go("live?name=billing")
    p.one("#live-ack").click()
    p.one("[data-test=live-start]").click()
    p.until("streaming", lambda: p.one("[data-test=live-state]").get_attribute("data-state") == "streaming")
    ids = [f"live-{i}" for i in range(3)]
    for i in ids:
        publish(admin, "orders", event(0, id=i))
    p.until("the published events in the tail", lambda: set(ids) <= set(p.attrs("table[data-test=live] tbody tr", "data-event-id")))
    # Acked from the page: billing catches up completely (the reset's redeliveries too).
    p.until("billing caught up through the tail's acks", lambda: all(x["backlog"] == 0 and x["in_flight"] == 0 for x in admin.ok("GET", "/v1/subscriptions/billing/stats")["partitions"]), timeout=40)
    p.shot("live")
    p.one("[data-test=live-stop]").click()


def check_moves(p, admin, pid):
    """SIGKILL the other instance: the cluster view shows its partitions moving to
    this one and the instance leaving once its lease runs out."""
    p.go("cluster")
    p.one("table[data-test=members]")
    before = admin.ok("GET", "/v1/cluster")
    me = before["instance"]
    theirs = sorted(str(x["partition"]) for x in before["partitions"] if x["topic"] == "orders" and x["owner"] != me)
    assert theirs, f"the other instance owns nothing: {before}"
    os.kill(pid, signal.SIGKILL)
    p.until("the other instance gone from the members", lambda: [r[0].replace(" (this one)", "") for r in p.rows("members")] == [me], timeout=40)

    def moved():
        got = {r[1].split("/")[1] for r in p.rows("moves") if r[1].startswith("orders/") and r[3] == me}
        return got == set(theirs)
    p.until(f"partitions {theirs} shown moving to {me}", moved, timeout=40)
    p.until("every cell of the grid coloured as this instance", lambda: set(p.attrs("ul[data-test=grid-orders] li", "data-owner")) == {me})
    p.shot("cluster-moves")


def check_keyboard(p):
    p.go("cluster")
    p.one("table[data-test=members]")
    body = p.d.find_element(By.TAG_NAME, "body")
    body.click()
    # Tab from the top of the page to the "Dead letters" link, then Enter.
    p.d.execute_script("document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0);")
    reached = None
    for _ in range(12):
        p.d.switch_to.active_element.send_keys(Keys.TAB)
        el = p.d.switch_to.active_element
        if el.get_attribute("data-view") == "deadletters":
            reached = el
            break
    assert reached is not None, "the Dead letters link is not reachable with Tab"
    reached.send_keys(Keys.ENTER)
    p.until("Enter on the link opens the view", lambda: p.d.current_url.endswith("#/deadletters"))


def check_narrow(p, admin_token):
    p.d.set_window_size(420, 900)
    p.sign_in(admin_token)
    p.until("signed in as an admin", lambda: p.one("#who").get_attribute("data-role") == "admin")
    try:
        for view in ("cluster", "deadletters", "tasks"):
            p.go(view)
            p.one("section.view h1")
            overflow = p.d.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, f"{view}: the page is {overflow}px wider than a narrow window"
            nav = p.one("#nav")
            assert nav.is_displayed()
        p.go("cluster")
        p.one("table[data-test=members]")
        p.shot("narrow-cluster")
    finally:
        p.d.set_window_size(1280, 800)


def check_client(p, client):
    p.go("cluster")
    p.sign_out()
    p.sign_in(client)
    p.until("signed in as a client", lambda: p.one("#who").get_attribute("data-role") == "client")
    # An admin-only view shows the API's refusal, never a blank page.
    p.go("deadletters")
    prob = p.one("[data-test=problem]")
    assert "Forbidden" in prob.text, prob.text
    # Stats are a client's; the reset is not: its button is disabled with the reason.
    p.go("subscriptions?name=billing")
    p.one("table[data-test=stats]")
    button = p.one("[data-test=reset-button]")
    assert not button.is_enabled(), "a client token can press the reset button"
    assert "admin token" in p.one("[data-test=admin-reason]").text
    p.shot("client-subscription")
    # Tasks are a client's.
    p.go("tasks")
    p.one("section[data-state=working] button")
    p.sign_out()


def check_errors(p):
    p.go("subscriptions?name=no-such-subscription")
    prob = p.one("[data-test=problem]")
    assert "Not Found" in prob.text and "no-such-subscription" in prob.text, prob.text


def check_sign_in(p, admin_token):
    p.d.get(f"{p.base}/console/")
    p.one("form[data-test=signin]")
    p.shot("sign-in")
    p.sign_in("not-a-token")
    prob = p.one("form[data-test=signin] [data-test=problem]")
    assert "Unauthorized" in prob.text, prob.text
    p.sign_in(admin_token)
    p.until("signed in as an admin", lambda: p.one("#who").get_attribute("data-role") == "admin")
    assert not p.css("[data-test=tokenless]"), "a tokenless banner with tokens configured"


def check_tokenless(p, base):
    p.d.get(f"{base}/console/#/cluster")
    p.one("[data-test=tokenless]")
    p.one("table[data-test=members]")
    p.shot("tokenless")


def no_browser_errors(d):
    bad = []
    for entry in d.get_log("browser"):
        m = entry.get("message", "")
        # Refusals the checks provoke on purpose are logged as failed loads; a script
        # error or a blocked (CSP) load is a defect.
        if "Content Security Policy" in m or "Uncaught" in m or "SyntaxError" in m or "TypeError" in m:
            bad.append(m)
    assert not bad, f"script errors or blocked loads in the browser: {bad}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--tokenless", required=True)
    ap.add_argument("--admin-token", required=True)
    ap.add_argument("--client-token", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    ap.add_argument("--shots", default="")
    ap.add_argument("--kill-pid", type=int, required=True, help="the other cluster instance, SIGKILLed by the moves check")
    args = ap.parse_args()
    admin = Api(args.base, args.admin_token)
    session = prepare(admin)
    o = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800", "--lang=en-US"):
        o.add_argument(a)
    o.binary_location = args.chromium
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(args.chromedriver), options=o)
    # The page's viewport at 1280x800, whatever the window decorations.
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    p = Page(d, args.base, args.shots)
    steps = [
        ("sign-in", lambda: check_sign_in(p, args.admin_token)),
        ("cluster", lambda: check_cluster(p, admin)),
        ("topics", lambda: check_topics(p, admin)),
        ("subscriptions", lambda: check_subscriptions(p, admin)),
        ("dead letters", lambda: check_deadletters(p, admin)),
        ("tasks", lambda: check_tasks(p, admin)),
        ("sessions", lambda: check_sessions(p, admin, session)),
        ("live", lambda: check_live(p, admin)),
        ("errors", lambda: check_errors(p)),
        ("keyboard", lambda: check_keyboard(p)),
        ("client token", lambda: check_client(p, args.client_token)),
        ("tokenless", lambda: check_tokenless(p, args.tokenless)),
        ("ownership moves", lambda: (p.sign_in(args.admin_token), check_moves(p, admin, args.kill_pid))),
        ("narrow window", lambda: (d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {}), check_narrow(p, args.admin_token))),
        ("no script error, nothing blocked by the CSP", lambda: no_browser_errors(d)),
    ]
    current = "?"
    try:
        for current, step in steps:
            started = time.monotonic()
            step()
            print(f"ok   {current} ({time.monotonic() - started:.1f}s)", flush=True)
    except AssertionError as e:
        print(f"FAIL {current}: {e}", flush=True)
        if args.shots:
            d.save_screenshot(f"{args.shots}/failure.png")
        print("browser log:", json.dumps(d.get_log("browser"), indent=1)[:4000])
        d.quit()
        sys.exit(1)
    d.quit()


if __name__ == "__main__":
    main()
