import EntitlementsMessages
import Testing

@testable import EntitlementsResolver

/// CheckEntitlementsRequest.explain: every candidate, why it is (not) active or counted,
/// and which rule decided (docs/entitlement-rules.md).
@Suite("explain")
struct ExplainTests {
    static func date(_ instant: Int64) -> String { "t0+\((instant - t0) / day)d" }

    func explain(_ record: CustomerRecord?, at instant: Int64, entitlementIds: [String] = []) -> Explanation {
        resolver.explain(record, at: instant, entitlementIds: entitlementIds, date: Self.date)
    }

    @Test("every chain and grant of an entitlement, the winner first, with why each is or is not active")
    func candidates() throws {
        let record = customer(
            [
                tx("m1", chain: "m", product: "monthly", at: t0, expires: t0 + 30 * day),
                tx("a1", chain: "a", product: "annual", at: t0 + 2 * day, expires: t0 + 367 * day),
                tx("r1", chain: "r", product: "monthly", at: t0, expires: t0 + 30 * day, revoked: t0 + 3 * day),
                tx("s1", chain: "s", product: "monthly", at: t0, expires: t0 + 90 * day, environment: .sandbox),
                tx("f1", chain: "f", product: "monthly", at: t0 + 40 * day, expires: t0 + 70 * day),
            ],
            grants: [grant("g", granted: t0, expires: t0 + 5 * day)]
        )
        let explanation = self.explain(record, at: t0 + 10 * day)
        let premium = try #require(explanation.entitlements.first { $0.entitlementId == "premium" })
        #expect(premium.candidates.map(\.id) == ["a", "m", "g", "r", "f", "s"])
        #expect(premium.candidates[0].won && premium.candidates[0].isActive && premium.candidates[0].productId == "annual")
        #expect(premium.decision == "won by rule 6: the later end (t0+367d over t0+30d); active")
        #expect(premium.candidates[1].reason == "current transaction m1 runs until t0+30d (rule 3)")
        #expect(premium.candidates[2].reason == "expired at t0+5d (rule 4)" && !premium.candidates[2].isActive)
        #expect(premium.candidates[3].reason == "current transaction r1 revoked at t0+3d (rule 2)")
        #expect(premium.candidates[4].reason == "not started: its first transaction is dated t0+40d (rule 1)" && !premium.candidates[4].counted)
        #expect(premium.candidates[5].reason == "other environment: sandbox (rule 1)" && !premium.candidates[5].counted)
        #expect(explanation.entitlements.map(\.entitlementId) == ["premium", "pro"], "pro from the annual product")
        // The losing monthly chain's end and the later chain's start change nothing shown.
        #expect(explanation.validUntilFrom == "expirationDate of appstore transaction a1")
    }

    @Test("asked about an entitlement nothing gives: each chain says why not")
    func nothingGivesIt() throws {
        let record = customer([tx("m1", chain: "m", product: "monthly", at: t0, expires: t0 + 30 * day)])
        let pro = try #require(self.explain(record, at: t0 + day, entitlementIds: ["pro"]).entitlements.first)
        #expect(pro.entitlementId == "pro")
        #expect(pro.candidates.map(\.reason) == ["its product monthly does not unlock pro (rule 5)"])
        #expect(pro.decision == "no candidate counts at this instant: not in the answer (rule 7)")
        #expect(self.explain(nil, at: t0, entitlementIds: ["pro"]).entitlements.first?.decision == "no such customer: nothing to give it")
    }

    @Test("a chain is listed once per entitlement though its products changed; a grant says what ended it first")
    func onceAndFirstEnd() throws {
        let record = customer(
            [
                tx("s1", chain: "s", product: "monthly", at: t0, expires: t0 + 30 * day, environment: .sandbox),
                tx("s2", chain: "s", product: "annual", at: t0 + 30 * day, expires: t0 + 395 * day, environment: .sandbox),
            ],
            grants: [
                grant("g1", granted: t0, expires: t0 + 5 * day, revoked: t0 + 8 * day),
                grant("g2", granted: t0, expires: t0 + 50 * day, revoked: t0 + 20 * day),
            ]
        )
        let premium = try #require(self.explain(record, at: t0 + 10 * day).entitlements.first { $0.entitlementId == "premium" })
        #expect(premium.candidates.filter { $0.id == "s" }.count == 1)
        #expect(premium.candidates.first { $0.id == "g1" }?.reason == "expired at t0+5d (rule 4)")
        #expect(premium.candidates.first { $0.id == "g2" }?.reason == "granted; revoked from t0+20d (rule 4)")
    }

    @Test("inactive everywhere: the entitlement shows, and the decision says why")
    func inactive() throws {
        let record = customer([tx("m1", chain: "m", product: "monthly", at: t0, expires: t0 + 30 * day)], states: [state(chain: "m", grace: t0 + 33 * day)])
        let premium = try #require(self.explain(record, at: t0 + 35 * day).entitlements.first)
        #expect(premium.candidates.first?.reason == "current transaction m1 expired at t0+30d; grace ended at t0+33d (rule 3)")
        #expect(premium.decision == "won by rule 6: the only counted candidate; no candidate is active, so the entitlement shows as inactive (rule 7)")
        let inGrace = try #require(self.explain(record, at: t0 + 31 * day).entitlements.first)
        #expect(inGrace.candidates.first?.reason == "current transaction m1 expired at t0+30d; in grace until t0+33d (rule 3)")
    }
}
