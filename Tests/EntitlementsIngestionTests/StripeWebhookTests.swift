import EntitlementsIngestion
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import Foundation
import NIOCore
import NIOPosix
import Testing

@Suite("Stripe webhooks end to end: signed events in, durable writes, the same answer as the write calls")
struct StripeWebhookTests {
    typealias F = StripeFixture
    static let now: Int64 = (F.start + 10 * F.day) * 1000
    static let seconds = now / 1000

    /// A month bought, auto-renew turned off, the renewal never comes: one subscription's life.
    static func life(user: String?, customer: String, subscription: String) -> [JSON] {
        [
            F.event("evt_c_\(customer)", "customer.created", created: F.start - 10, F.customer(customer, user: user)),
            F.event("evt_s1_\(customer)", "customer.subscription.created", created: F.start, F.subscription(subscription, customer: customer, status: "active", periodStart: F.start, periodEnd: F.start + 30 * F.day)),
            F.event("evt_i1_\(customer)", "invoice.paid", created: F.start + 1, F.invoice("in_\(customer)", subscription: subscription, customer: customer, periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create")),
            F.event(
                "evt_s2_\(customer)", "customer.subscription.updated", created: F.start + 5 * F.day,
                F.subscription(subscription, customer: customer, status: "active", periodStart: F.start, periodEnd: F.start + 30 * F.day, cancelAtPeriodEnd: true, canceledAt: F.start + 5 * F.day, cancellationReason: "cancellation_requested")
            ),
        ]
    }

    @Test("a subscription's events give the answer the same purchase gives through RecordTransaction and UpdateSubscriptionState")
    func sameAnswerAsWriteCalls() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        for event in Self.life(user: "alice", customer: "cus_a", subscription: "sub_a") {
            let answer = await fixture.deliver(event, signedAt: Self.seconds)
            #expect(answer.status == 200, "\(answer.body)")
        }
        // The same purchase, written by hand for another user.
        _ = try await fixture.write(.recordTransaction(RecordTransactionRequest(userId: "bob", transaction: Transaction(
            originalTransactionId: "sub_a", transactionId: "in_cus_a", store: .stripe, productId: "price_monthly", transactionDate: F.start * 1000,
            expirationDate: (F.start + 30 * F.day) * 1000, environment: .sandbox, ownershipType: .owner, type: .subscriptionStarted,
            priceMicros: 9_990_000, currency: "USD", verified: true
        ))))
        _ = try await fixture.write(.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "bob", state: SubscriptionState(
            store: .stripe, originalTransactionId: "sub_a", autoRenewEnabled: false, autoRenewDisabledDate: (F.start + 5 * F.day) * 1000,
            cancellationReason: .customer
        ))))
        for (instant, active) in [(Self.now, true), ((F.start + 31 * F.day) * 1000, false)] {
            try await fixture.expectSameAnswer("alice", as: "bob", at: instant, active: active)
        }
        #expect(try await fixture.check("stripe:cus_a", at: Self.now).customerId == "alice")
        try await fixture.stop()
    }

    @Test("a redelivered event changes nothing and is answered 200; an older state delivered late does not roll the newer back")
    func replaysAndOrder() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        let life = Self.life(user: "carol", customer: "cus_c", subscription: "sub_c")
        for event in life {
            #expect(await fixture.deliver(event, signedAt: Self.seconds).status == 200)
        }
        let before = try fixture.record("carol")
        for event in life.reversed() {
            let again = await fixture.deliver(event, signedAt: Self.seconds)
            #expect(again.status == 200)
            #expect(again.body.contains(#""changed":false"#), "\(again.body)")
        }
        #expect(try fixture.record("carol") == before)
        #expect(try fixture.record("carol")?.subscriptions.first?.autoRenewEnabled == false)
        try await fixture.stop()
    }

    @Test("every order of a subscription's events, redelivered as Stripe retries the refused ones, ends in the same state")
    func everyOrder() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        // Paid, ended early by deletion, refunded: identity only through the customer event.
        func events(_ n: Int) -> [JSON] {
            let customer = "cus_\(n)"
            return [
                F.event("evt_c\(n)", "customer.created", created: F.start - 10, F.customer(customer, user: "user\(n)")),
                F.event("evt_i\(n)", "invoice.paid", created: F.start + 1, F.invoice("in_1", subscription: "sub_1", customer: customer, periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create")),
                F.event("evt_u\(n)", "customer.subscription.updated", created: F.start + 2 * F.day, F.subscription("sub_1", customer: customer, status: "past_due", periodStart: F.start, periodEnd: F.start + 30 * F.day)),
                F.event("evt_d\(n)", "customer.subscription.deleted", created: F.start + 4 * F.day, F.subscription("sub_1", customer: customer, status: "canceled", periodStart: F.start, periodEnd: F.start + 30 * F.day, canceledAt: F.start + 4 * F.day, endedAt: F.start + 4 * F.day)),
                F.event("evt_r\(n)", "charge.refunded", created: F.start + 6 * F.day, F.charge("ch_1", customer: customer, invoice: "in_1")),
            ]
        }
        var states: [String: [Int]] = [:]
        var n = 0
        for order in permutations(Array(0..<5)) {
            n += 1
            var pending = order.map { events(n)[$0] }
            var rounds = 0
            while !pending.isEmpty, rounds < 6 {
                rounds += 1
                var refused: [JSON] = []
                for event in pending {
                    let answer = await fixture.deliver(event, signedAt: Self.seconds)
                    if answer.status == 503 {
                        refused.append(event)
                    } else {
                        #expect(answer.status == 200, "\(answer.body)")
                    }
                }
                pending = refused
            }
            #expect(pending.isEmpty, "order \(order): still refused after \(rounds) rounds")
            guard let record = try fixture.record("user\(n)") else {
                Issue.record("order \(order): no customer")
                continue
            }
            let final = "\(record.transactions) \(record.subscriptions)"
            states[final, default: []].append(n)
        }
        #expect(states.count == 1, "\(states.keys.joined(separator: "\n"))")
        let record = try fixture.record("user1")
        #expect(record?.transactions.first?.revocationDate == (F.start + 4 * F.day) * 1000, "revoked when the subscription ended, before the refund")
        #expect(record?.subscriptions.first?.endedDate == (F.start + 4 * F.day) * 1000)
        try await fixture.stop()
    }

    @Test("the same five events delivered all at once, as Stripe's parallel deliveries do, end in the state of any one order")
    func concurrentDeliveries() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        for n in 1...5 {
            let customer = "cus_par\(n)"
            var pending: [JSON] = [
                F.event("evt_c", "customer.created", created: F.start - 10, F.customer(customer, user: "par\(n)")),
                F.event("evt_i", "invoice.paid", created: F.start + 1, F.invoice("in_1", subscription: "sub_1", customer: customer, periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create")),
                F.event("evt_d", "customer.subscription.deleted", created: F.start + 4 * F.day, F.subscription("sub_1", customer: customer, status: "canceled", periodStart: F.start, periodEnd: F.start + 30 * F.day, canceledAt: F.start + 4 * F.day, endedAt: F.start + 4 * F.day)),
                F.event("evt_r", "charge.refunded", created: F.start + 6 * F.day, F.charge("ch_1", customer: customer, invoice: "in_1")),
                F.event("evt_r", "charge.refunded", created: F.start + 6 * F.day, F.charge("ch_1", customer: customer, invoice: "in_1")),
            ]
            var rounds = 0
            while !pending.isEmpty, rounds < 6 {
                rounds += 1
                let batch = pending
                pending = await withTaskGroup(of: JSON?.self) { group in
                    for event in batch {
                        group.addTask {
                            let refused = await fixture.deliver(event, signedAt: Self.seconds).status == 503
                            return refused ? Optional(event) : Optional<JSON>.none
                        }
                    }
                    var refused: [JSON] = []
                    for await event in group {
                        if let event {
                            refused.append(event)
                        }
                    }
                    return refused
                }
            }
            #expect(pending.isEmpty)
            let record = try fixture.record("par\(n)")
            #expect(record?.transactions.map(\.revocationDate) == [(F.start + 4 * F.day) * 1000])
        }
        try await fixture.stop()
    }

    @Test("a refund before an early end keeps its earlier date, even when the payment is delivered again after both")
    func refundThenEndThenPaymentAgain() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        let paid = F.event("evt_p", "invoice.paid", created: F.start + 1, F.invoice("in_1", subscription: "sub_1", customer: "cus_e", user: "erin", periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create"))
        let events = [
            paid,
            F.event("evt_r", "charge.refunded", created: F.start + 2 * F.day, F.charge("ch_1", customer: "cus_e", invoice: "in_1")),
            F.event("evt_d", "customer.subscription.deleted", created: F.start + 3 * F.day, F.subscription("sub_1", customer: "cus_e", status: "canceled", periodStart: F.start, periodEnd: F.start + 30 * F.day, canceledAt: F.start + 3 * F.day, endedAt: F.start + 3 * F.day)),
            paid,
        ]
        for event in events {
            let answer = await fixture.deliver(event, signedAt: Self.seconds)
            #expect(answer.status == 200, "\(answer.body)")
        }
        #expect(try fixture.record("erin")?.transactions.first?.revocationDate == (F.start + 2 * F.day) * 1000)
        try await fixture.stop()
    }

    @Test("a refund of a payment never recorded is retried for a day, then acknowledged and counted as ignored")
    func refundOfUnknownPayment() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        #expect(await fixture.deliver(F.event("evt_c", "customer.created", created: F.start, F.customer("cus_f", user: "frank")), signedAt: Self.seconds).status == 200)
        let recent = F.event("evt_r1", "charge.refunded", created: Self.seconds - 3_600, F.charge("ch_1", customer: "cus_f", invoice: "in_never"))
        let recentAnswer = await fixture.deliver(recent, signedAt: Self.seconds)
        #expect(recentAnswer.status == 503 && recentAnswer.body.contains("not_recorded_yet"), "\(recentAnswer.body)")
        let old = F.event("evt_r2", "charge.refunded", created: Self.seconds - 25 * 3_600, F.charge("ch_2", customer: "cus_f", invoice: "in_never"))
        let oldAnswer = await fixture.deliver(old, signedAt: Self.seconds)
        #expect(oldAnswer.status == 200 && oldAnswer.body.contains(#""ignored":"refund_of_unknown_payment""#), "\(oldAnswer.body)")
        try await fixture.stop()
    }

    @Test("a metadata user id that is not NFC is refused (400 invalid_id) before anything is read or written")
    func userIdNotNFC() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        let decomposed = F.event("evt_z1", "customer.created", created: F.start, F.customer("cus_z", user: "Zoe\u{308}"))
        let refused = await fixture.deliver(decomposed, signedAt: Self.seconds)
        #expect(refused.status == 400 && refused.body.contains(#""reason":"invalid_id""#) && refused.body.contains("NFC"), "\(refused.body)")
        #expect(try await fixture.check("stripe:cus_z", at: Self.now).customerId == nil)
        let composed = F.event("evt_z2", "customer.created", created: F.start, F.customer("cus_z", user: "Zo\u{EB}"))
        #expect(await fixture.deliver(composed, signedAt: Self.seconds).status == 200)
        let linked = try await fixture.check("stripe:cus_z", at: Self.now).customerId
        #expect(linked.map { Array($0.utf8) } == Array("Zo\u{EB}".utf8))
        try await fixture.stop()
    }

    @Test("over HTTP: 200 for a signed event, 400 with a reason for a bad signature, 404 elsewhere, 405 for GET, 503 for an unknown user")
    func overHTTP() async throws {
        let fixture = try await WebhookFixture(now: Self.now)
        let port = fixture.port
        let body = F.event("evt_h1", "customer.created", created: F.start, F.customer("cus_h", user: "dave")).text
        let header = StripeSignatureVerifier.header(body: Array(body.utf8), timestamp: Self.seconds, secret: WebhookFixture.secret)
        func post(_ path: String, _ body: String, signature: String?, method: String = "POST") async -> String {
            let request = "\(method) \(path) HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\n"
                + (signature.map { "Stripe-Signature: \($0)\r\n" } ?? "") + "Connection: close\r\n\r\n\(body)"
            return await exchange(port: port, request)
        }
        let accepted = await post("/webhooks/stripe", body, signature: header)
        #expect(accepted.hasPrefix("HTTP/1.1 200"), "\(accepted)")
        #expect(accepted.contains(#""customerId":"dave""#))
        let forged = await post("/webhooks/stripe", body, signature: "t=\(Self.seconds),v1=" + String(repeating: "00", count: 32))
        #expect(forged.hasPrefix("HTTP/1.1 400"), "\(forged)")
        #expect(forged.contains(#""reason":"bad_signature""#))
        let unsigned = await post("/webhooks/stripe", body, signature: nil)
        #expect(unsigned.contains(#""reason":"missing_signature""#))
        #expect(await post("/webhooks/appstore", body, signature: header).hasPrefix("HTTP/1.1 404"))
        #expect(await post("/webhooks/stripe", "", signature: header, method: "GET").hasPrefix("HTTP/1.1 405"))
        let stranger = F.event("evt_h2", "charge.refunded", created: F.start, F.charge("ch_9", customer: "cus_nobody", invoice: "in_9")).text
        let retried = await post("/webhooks/stripe", stranger, signature: StripeSignatureVerifier.header(body: Array(stranger.utf8), timestamp: Self.seconds, secret: WebhookFixture.secret))
        #expect(retried.hasPrefix("HTTP/1.1 503"), "\(retried)")
        #expect(retried.contains(#""reason":"unknown_identity""#))
        #expect(try fixture.record("cus_nobody") == nil, "nothing written for an unknown user")
        try await fixture.stop()
    }
    @Test("over HTTP: a request that does not arrive whole within --frame-timeout is answered 408 too_slow, and its connection closed")
    func slowSender() async throws {
        let fixture = try await WebhookFixture(now: Self.now, frameTimeout: .milliseconds(300))
        let request = "POST /webhooks/stripe HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":"
        let answer = await exchange(port: fixture.port, request)
        #expect(answer.hasPrefix("HTTP/1.1 408"), "\(answer)")
        #expect(answer.contains(#""reason":"too_slow""#) && answer.contains("--frame-timeout"), "\(answer)")
        #expect(answer.lowercased().contains("connection: close"))
        try await fixture.stop()
    }
}

func permutations(_ elements: [Int]) -> [[Int]] {
    guard elements.count > 1 else {
        return [elements]
    }
    return elements.indices.flatMap { index in
        var rest = elements
        let first = rest.remove(at: index)
        return permutations(rest).map { [first] + $0 }
    }
}

/// Sends `request` on a new loopback connection and reads until the server closes it.
func exchange(port: Int, _ request: String) async -> String {
    await withCheckedContinuation { continuation in
        Thread {
            let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            defer { close(fd) }
            var address = sockaddr_in()
            address.sin_family = sa_family_t(AF_INET)
            address.sin_port = in_port_t(UInt16(port).bigEndian)
            address.sin_addr.s_addr = inet_addr("127.0.0.1")
            var timeout = timeval(tv_sec: 10, tv_usec: 0)
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
            let connected = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
            }
            guard connected == 0 else {
                continuation.resume(returning: "connect failed")
                return
            }
            let bytes = Array(request.utf8)
            _ = bytes.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
            var out: [UInt8] = []
            var buffer = [UInt8](repeating: 0, count: 65536)
            while true {
                let count = recv(fd, &buffer, buffer.count, 0)
                if count <= 0 {
                    break
                }
                out += buffer[0..<count]
            }
            continuation.resume(returning: String(decoding: out, as: UTF8.self))
        }.start()
    }
}
