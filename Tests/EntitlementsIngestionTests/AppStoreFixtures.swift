import EntitlementsIngestion
import Foundation

/// App Store Server Notifications V2 as Apple sends them, signed by the openssl-made chain
/// of ``AppleLikeCertificates`` (the test root stands in for Apple Root CA - G3).
struct AppStoreFixture {
    static let bundleId = "com.example.app"
    static let monthly = "com.example.premium.monthly"
    static let lifetime = "com.example.lifetime"
    static let day: Int64 = 86_400_000

    let certificates: AppleLikeCertificates
    /// An instant just after the certificates were made: notifications are signed from it
    /// on (the certificates are valid for ten days from then).
    let base: Int64

    init() throws {
        self.certificates = try AppleLikeCertificates.shared.get()
        self.base = Int64(Date().timeIntervalSince1970 * 1000) + 1000
    }

    var settings: AppStoreWebhookSettings {
        get throws {
            AppStoreWebhookSettings(roots: [try AppStoreJWSVerifier.loadRoot(path: self.certificates.path("root.pem"))], bundleIds: [Self.bundleId])
        }
    }

    /// A transaction of the chain `original`: `purchased` and `expires` are offsets in days
    /// from `base`.
    func transaction(
        _ id: String,
        original: String,
        token: String?,
        purchased: Int64,
        product: String = monthly,
        reason: String? = nil,
        revoked: Int64? = nil,
        fields: [(String, JSON)] = []
    ) -> JSON {
        var object: [(String, JSON)] = [
            ("transactionId", .string(id)), ("originalTransactionId", .string(original)), ("bundleId", .string(Self.bundleId)),
            ("productId", .string(product)), ("purchaseDate", .integer(self.base + purchased * Self.day)),
            ("originalPurchaseDate", .integer(self.base + purchased * Self.day)), ("quantity", 1),
            ("type", product == Self.lifetime ? "Non-Consumable" : "Auto-Renewable Subscription"),
            ("inAppOwnershipType", "PURCHASED"), ("signedDate", .integer(self.base)), ("environment", "Sandbox"),
            ("transactionReason", .string(reason ?? (id == original ? "PURCHASE" : "RENEWAL"))), ("storefront", "USA"),
            ("currency", "USD"), ("price", 9990),
        ]
        if product != Self.lifetime {
            object.append(("expiresDate", .integer(self.base + (purchased + 30) * Self.day)))
        }
        if let token {
            object.append(("appAccountToken", .string(token)))
        }
        if let revoked {
            object.append(("revocationDate", .integer(self.base + revoked * Self.day)))
            object.append(("revocationReason", 0))
        }
        for (key, value) in fields {
            object.removeAll { $0.0 == key }
            object.append((key, value))
        }
        return .object(object)
    }

    func renewal(original: String, renews: Bool, retrying: Bool = false, grace: Int64? = nil, fields: [(String, JSON)] = []) -> JSON {
        var object: [(String, JSON)] = [
            ("originalTransactionId", .string(original)), ("autoRenewProductId", .string(Self.monthly)), ("productId", .string(Self.monthly)),
            ("autoRenewStatus", renews ? 1 : 0), ("isInBillingRetryPeriod", .bool(retrying)), ("signedDate", .integer(self.base)),
            ("environment", "Sandbox"), ("recentSubscriptionStartDate", .integer(self.base)),
        ]
        if let grace {
            object.append(("gracePeriodExpiresDate", .integer(self.base + grace * Self.day)))
        }
        object.append(contentsOf: fields)
        return .object(object)
    }

    /// A signed notification; `at` is minutes after `base` (its signedDate).
    func notification(
        _ type: String,
        subtype: String? = nil,
        uuid: String,
        at minutes: Int64,
        transaction: JSON?,
        renewal: JSON?,
        bundleId: String = bundleId
    ) throws -> String {
        var data: [(String, JSON)] = [("appAppleId", 1_234_567), ("bundleId", .string(bundleId)), ("bundleVersion", "1"), ("environment", "Sandbox")]
        if let transaction {
            data.append(("signedTransactionInfo", .string(try self.certificates.jws(transaction.text))))
        }
        if let renewal {
            data.append(("signedRenewalInfo", .string(try self.certificates.jws(renewal.text))))
        }
        data.append(("status", 1))
        var payload: [(String, JSON)] = [("notificationType", .string(type))]
        if let subtype {
            payload.append(("subtype", .string(subtype)))
        }
        payload += [("notificationUUID", .string(uuid)), ("data", .object(data)), ("version", "2.0"), ("signedDate", .integer(self.signedDate(minutes)))]
        return try self.certificates.jws(JSON.object(payload).text)
    }

    func signedDate(_ minutes: Int64) -> Int64 { self.base + minutes * 60_000 }
}
