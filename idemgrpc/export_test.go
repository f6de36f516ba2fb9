package idemgrpc

// V1Tenant is v1.0's DefaultTenant, for tests that store records as v1.0
// did.
var V1Tenant = v1Tenant
