"""ignis/server"""
