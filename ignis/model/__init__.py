"""ignis/model"""
